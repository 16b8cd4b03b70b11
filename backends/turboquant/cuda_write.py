"""TurboQuant's cache write on CUDA (``write_kernels.cu``, built with the machine's nvcc on first
use): 16 coordinates a lane, every preset, head dims 64 / 128 / 256, keys in bf16, fp16 or
fp32, the keys' RoPE and the entered pages' tails in the same launch. Chosen by
``Tuning.triton.turboquant_cuda_write``; every other write runs the Triton kernel
(:func:`~attn_ops.backends.turboquant.write_kernels.cache_write_triton`)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from attn_ops.backends.turboquant.cuda_build import build_or_report, load_extension
from attn_ops.backends.turboquant.format import code_lookup

__all__ = ["cuda_write_built", "cuda_write_serves", "turboquant_cuda_write"]

_SOURCE = Path(__file__).with_name("write_kernels.cu")
_HEAD_DIMS = (64, 128, 256)
_PRESETS = ((8, 4), (4, 4), (3, 4), (3, 3))  # (key bits, value bits; 8: fp8 keys)


def cuda_write_serves(key, value, kv_cache, slot_mapping, preset, cos_sin=None) -> bool:
    """Whether :func:`turboquant_cuda_write` serves the call: CUDA tensors, a head dim it was
    built for, keys and values of one float dtype in rows of 16-byte aligned 16-element
    pieces (its loads), int64 slots, a cache whose slots are contiguous bytes at even
    addresses (its 16-bit stores; fewer than 2^31 slots), fp32 cos / sin in aligned rows, a
    key codebook the one-read lookup separates."""
    d = key.shape[2]
    return (key.is_cuda and d in _HEAD_DIMS
            and key.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and value.dtype == key.dtype and slot_mapping.dtype == torch.int64
            and kv_cache.stride(-1) == 1 and kv_cache.data_ptr() % 2 == 0
            and all(st % 2 == 0 for st in (*kv_cache.stride()[:-1], kv_cache.shape[-1]))
            and kv_cache.shape[0] * kv_cache.shape[2] < 2 ** 31
            and key.shape[0] * key.shape[1] < 2 ** 31
            and all(_aligned(x) for x in (key, value))
            and (cos_sin is None or (cos_sin.dtype == torch.float32 and _aligned(cos_sin)))
            and (preset.key_bits, preset.value_bits) in _PRESETS
            and (preset.fp8_keys or code_lookup(d, preset.key_bits, key.device) is not None))


def _aligned(x: torch.Tensor) -> bool:
    """Rows of 16-byte aligned 16-element pieces: a 16-byte aligned start, unit last stride and
    every other stride a multiple of 16 bytes (a non-unit last stride is made contiguous)."""
    size = x.element_size()
    return (x.stride(-1) != 1 or (x.data_ptr() % 16 == 0 and all(
        (st * size) % 16 == 0 for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)))


@functools.cache
def _module():
    """The extension (:func:`~attn_ops.backends.turboquant.cuda_build.load_extension`)."""
    return load_extension(_SOURCE, "attn_ops_turboquant_write", ["-O3", "-std=c++17"])


@functools.cache
def cuda_write_built() -> bool:
    """Whether the write builds (once a process). A failed build is logged once with its
    reason, and the writes stay on the Triton kernel."""
    return build_or_report(_module, "TurboQuant's CUDA write", "writes run on the Triton kernel",
                           "triton.turboquant_cuda_write")


def turboquant_cuda_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, preset,
                          cos_sin: torch.Tensor | None = None) -> None:
    """``torch.ops.attn.turboquant_cache_update`` in one launch of the CUDA write (inputs
    already checked; :func:`cuda_write_serves`)."""
    d = key.shape[2]
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if cos_sin is not None and cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    cells, scale, offset = key.new_zeros(1, 2, dtype=torch.float32), 0.0, 0.0  # (fp8 keys)
    if not preset.fp8_keys:
        cells, scale, offset = code_lookup(d, preset.key_bits, key.device)
    _module().write(key, value, kv_cache, slot_mapping.contiguous(), cells, scale, offset,
                    cos_sin, preset.key_bits, preset.value_bits)
