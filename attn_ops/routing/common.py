"""What every family's routing shares: the device's facts (:class:`DeviceFacts`), the kernel
names (:class:`Kernel`), the shape of a route (:class:`PartRoute`, :class:`Split`) and the tile
arithmetic the Triton kernels of several families use."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from attn_ops.tuning import FA4Tile

__all__ = ["DeviceFacts", "Kernel", "PartRoute", "Split", "SplitMode", "combine_split_block",
           "cdiv", "pow2", "triton_head_tiles"]

# SM counts of GPUs by compute capability, for simulated platforms (the CLI, tests): a real
# device's count is read from it.
_SMS_BY_CAPABILITY = {(8, 0): 108, (8, 6): 84, (8, 9): 128, (9, 0): 132, (10, 0): 148,
                      (12, 0): 170}
# (shared memory per SM, the most one block may opt into), bytes, of each capability's GPUs
_SHARED_MEMORY_BY_CAPABILITY = {(8, 0): (167936, 166912), (8, 6): (102400, 101376),
                                (8, 7): (167936, 166912), (8, 9): (102400, 101376),
                                (9, 0): (233472, 232448), (10, 0): (233472, 232448),
                                (12, 0): (102400, 101376)}


@dataclass(frozen=True)
class DeviceFacts:
    """What the rules read of a device: its SM count and compute capability."""

    num_sms: int
    capability: tuple[int, int] | None = None
    shared_memory: tuple[int, int] | None = None  # (per SM, per block opted in), bytes

    @property
    def major(self) -> int:
        return self.capability[0] if self.capability else 0

    @classmethod
    def of(cls, device: torch.device) -> DeviceFacts:
        """A real device's facts (an interpreter's CPU "device" counts 8 SMs, so that CPU tests
        exercise split-KV)."""
        if device.type != "cuda":
            return cls(8, None)
        return _cuda_facts(device.index if device.index is not None
                           else torch.cuda.current_device())

    @classmethod
    def for_platform(cls, platform) -> DeviceFacts:
        """A platform's facts: the device's own where it is this machine's, else (simulated) the
        SM count of the usual GPU of that capability."""
        cap = platform.capability
        if not platform.simulated and platform.is_gpu and torch.cuda.is_available():
            return cls.of(torch.device("cuda"))
        return cls(_SMS_BY_CAPABILITY.get(cap, 132 if cap else 8), cap,
                   _SHARED_MEMORY_BY_CAPABILITY.get(cap))


@functools.cache
def _cuda_facts(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    per_block = getattr(props, "shared_memory_per_block_optin", None)
    shared = (int(per_sm), int(per_block)) if per_sm and per_block \
        else _SHARED_MEMORY_BY_CAPABILITY.get(cap)
    return DeviceFacts(props.multi_processor_count, cap, shared)


class Kernel(enum.Enum):
    """The kernels a part of a step can run on (values: how tables and errors name them)."""

    FLASHINFER_FA2 = "FlashInfer FA2 paged (tensor-core decode)"
    FLASHINFER_FA3 = "FlashInfer FA3 paged (sm90)"
    FA4 = "FlashAttention 4"
    TRITON = "TRITON_ATTN unsplit decode"
    FLASHINFER_RAGGED = "FlashInfer ragged prefill"
    TORCH_MHA = "PyTorch MHA (REFERENCE_MLA's, one request at a time)"
    FLASHINFER_MLA_FA3 = "FlashInfer MLA fa3 (sm90)"
    FLASHINFER_MLA_FA2 = "FlashInfer MLA fa2"
    FLASHMLA = "FlashMLA dense decode"
    FA3_MLA = "FlashAttention 3 MLA path (q_v)"
    TRITON_MLA = "TRITON_MLA split-KV absorbed kernel"
    SSM_TORCH = "PyTorch recurrences (the reference, token by token)"
    SSM_TRITON = "our Triton recurrent kernels"
    SSM_TRITON_CHUNKED = "our Triton chunked kernels"


class SplitMode(enum.Enum):
    LIBRARY_RULE = "FlashInfer's own split rule"
    NONE = "no split"
    FIXED = "fixed chunks"


@dataclass(frozen=True)
class Split:
    """FlashInfer's split-KV for a part: its own rule, none, or chunks of ``chunk_pages``."""

    mode: SplitMode
    chunk_pages: int | None = None

    def __str__(self) -> str:
        if self.mode is SplitMode.FIXED:
            return f"split into chunks of {self.chunk_pages} pages"
        return str(self.mode.value)


@dataclass(frozen=True)
class PartRoute:
    """The kernel of one part of a step, its split (FlashInfer kernels), its FA4 tile, and the
    rule that chose it."""

    kernel: Kernel
    split: Split | None = None
    fa4_tile: FA4Tile | None = None
    why: str = ""


def _waves(items: int, num_sms: int) -> float:
    return items / num_sms


def combine_split_block(splits: int, value_width: int) -> int:
    """Splits a split-combine program reads at a time: all of them while their rows of
    ``value_width`` fp32 values stay within 4096 values (32 registers a thread at 4 warps),
    else in blocks that do -- TRITON_ATTN's few narrow splits in one pass, MLA's many 512-wide
    ones in blocks of 8, never a spilled tile."""
    return min(pow2(splits), max(1, 4096 // pow2(value_width)))


def triton_head_tiles(head_dim: int, v_head_dim: int, cache_bytes: int) -> tuple[int, int]:
    """The Triton kernel's padded (QK, V) head-dim tiles: powers of two of at least 16
    elements, and of at least 64 for 1-byte (fp8) caches -- Triton 3.6 miscompiles the fp8 ->
    16-bit conversion of a K/V tile whose rows are under 64 bytes on sm90 (an out-of-bounds
    shared-memory read), so narrower fp8 heads load masked 64-wide tiles."""
    least = 64 if cache_bytes == 1 else 16
    return pow2(head_dim, least), pow2(v_head_dim, least)


def pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``at_least``): padded tile dims. Launch
    wrappers use this and :func:`cdiv`, not ``triton.next_power_of_2`` / ``triton.cdiv``: from
    Triton 3.5 those are constexpr functions, about 2 us a host call, several a launch."""
    return max(at_least, 1 << (n - 1).bit_length() if n > 1 else 1)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of integers (grid sizes)."""
    return -(-a // b)
