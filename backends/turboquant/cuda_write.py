"""TurboQuant's cache write on CUDA (``write_kernels.cu``, built with the machine's nvcc on first
use): one warp a (token, KV head), every preset, head dims 64 / 128 / 256, keys in bf16, fp16 or
fp32, the keys' RoPE and the entered pages' tails in the same launch. Chosen by
``Tuning.triton.turboquant_cuda_write``; every other write runs the Triton kernel
(:func:`~attn_ops.backends.turboquant.write_kernels.cache_write_triton`)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from attn_ops.backends.turboquant.cuda_build import build_or_report, load_extension

__all__ = ["cuda_write_built", "cuda_write_serves", "turboquant_cuda_write"]

_SOURCE = Path(__file__).with_name("write_kernels.cu")
_HEAD_DIMS = (64, 128, 256)
_PRESETS = ((8, 4), (4, 4), (3, 4), (3, 3))  # (key bits, value bits; 8: fp8 keys)


def cuda_write_serves(key, value, kv_cache, slot_mapping, preset, cos_sin=None) -> bool:
    """Whether :func:`turboquant_cuda_write` serves the call: CUDA tensors, a head dim it was
    built for, keys and values of one float dtype, int64 slots, a cache whose slots are
    contiguous bytes, fp32 cos / sin."""
    return (key.is_cuda and key.shape[2] in _HEAD_DIMS
            and key.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and value.dtype == key.dtype and slot_mapping.dtype == torch.int64
            and kv_cache.stride(-1) == 1
            and (cos_sin is None or cos_sin.dtype == torch.float32)
            and (preset.key_bits, preset.value_bits) in _PRESETS)


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
    from attn_ops.backends.turboquant.format import codebook

    d = key.shape[2]
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if cos_sin is not None and cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    mid = key.new_zeros(1, dtype=torch.float32)  # (fp8 keys: unread)
    if not preset.fp8_keys:
        _, mid = codebook(d, preset.key_bits, key.device)
    _module().write(key, value, kv_cache, slot_mapping.contiguous(), mid.contiguous(), cos_sin,
                    preset.key_bits, preset.value_bits)
