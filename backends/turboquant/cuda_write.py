"""TurboQuant's cache write on CUDA (``write_kernels.cu``, built with the machine's nvcc on first
use): one warp a (token, KV head), every preset, head dims 64 / 128 / 256, keys in bf16, fp16 or
fp32, the keys' RoPE and the entered pages' tails in the same launch. Chosen by
``Tuning.triton.turboquant_cuda_write``; every other write runs the Triton kernel
(:func:`~attn_ops.backends.turboquant.write_kernels.cache_write_triton`)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

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
    """The extension; its name carries a hash of the source and flags, so a build another
    checkout or machine left in torch's extension cache is reused only for the same source."""
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-std=c++17"]
    digest = hashlib.sha1(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    return load(name=f"attn_ops_turboquant_write_{digest}", sources=[str(_SOURCE)],
                extra_cuda_cflags=flags, verbose=False)


@functools.cache
def cuda_write_built() -> bool:
    """Whether the write builds (nvcc and ninja on the machine; once a process). A failed
    build is logged once with its reason, and the writes stay on the Triton kernel."""
    import logging

    log = logging.getLogger("attn_ops")
    try:
        _module()
        return True
    except Exception as e:  # noqa: BLE001 -- any build failure: the Triton write serves
        log.warning(
            "TurboQuant's CUDA write did not build (%s: %s); writes run on the Triton kernel. "
            "Set tuning triton.turboquant_cuda_write=false to skip the build.",
            type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
        return False


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
