"""TurboQuant's decode on the tensor cores (``decode_kernels.cu``, built with the machine's
nvcc on first use): uniform decode steps (one query a request) over every preset's cache at
head dims 64 / 128 / 256 and power-of-two pages of 16 or more; every other step runs
TRITON_ATTN's kernels (:func:`~attn_ops.backends.turboquant.ops.triton_turboquant_attention`).
Chosen by ``Tuning.triton.turboquant_cuda_decode``.

The query is rotated once for 3- and 4-bit keys (``q H``; they are stored rotated; before the
launch, or in it under ``Tuning.triton.turboquant_cuda_fused_rotation``); each
(request, KV head) runs ``splits`` CTAs of four warps, each warp a split of its own, and the
splits' partial outputs and log-sum-exps are merged by a second launch. Every decision reads
shapes only (the block table's width is the context bound), so a step captures in a CUDA
graph."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from attn_ops.backends.turboquant.cuda_build import build_or_report, load_extension

__all__ = ["build_of", "cuda_decode_built", "cuda_decode_serves", "turboquant_cuda_decode"]

_SOURCE = Path(__file__).with_name("decode_kernels.cu")
_WARPS = 4  # (the kernel's warps a CTA, each a split)
_HEAD_DIMS = (64, 128, 256)


def cuda_decode_serves(query, kv_cache, seq_lens, preset) -> bool:
    """Whether :func:`turboquant_cuda_decode` serves the call: one query a request (its rows
    are the requests), a head dim it was built for, a power-of-two page of at least 16
    positions (a step's 16 slots are one contiguous run, copied in 16-byte chunks), a GQA
    group of at most 16 query heads, a contiguous cache at a 16-byte aligned address, on a
    CUDA device."""
    page = kv_cache.shape[2]
    heads, kv_heads = query.shape[1], kv_cache.shape[1]
    return (query.is_cuda and query.shape[0] == seq_lens.shape[0]
            and preset.key_bits in (3, 4, 8) and preset.value_bits in (3, 4)
            and kv_cache.is_contiguous() and kv_cache.data_ptr() % 16 == 0
            and query.shape[2] in _HEAD_DIMS and page >= 16 and page & (page - 1) == 0
            and heads % kv_heads == 0 and heads // kv_heads <= 16)


def build_of(triton_tuning) -> tuple[int, bool]:
    """The extension build a tuning asks for: ``(turboquant_cuda_min_blocks,
    turboquant_cuda_norm_mma)``, the arguments of :func:`cuda_decode_built`."""
    return triton_tuning.turboquant_cuda_min_blocks, triton_tuning.turboquant_cuda_norm_mma


@functools.cache
def _module(min_blocks: int = 0, norm_mma: bool = False):
    """The extension, built for ``min_blocks`` CTAs an SM (0: the compiler's choice;
    ``Tuning.triton.turboquant_cuda_min_blocks``) and with the norm correction on the tensor
    cores where ``norm_mma`` (``Tuning.triton.turboquant_cuda_norm_mma``), each a build of its
    own (:func:`~attn_ops.backends.turboquant.cuda_build.load_extension`)."""
    flags = ["-O3", "-std=c++17"]
    if min_blocks:
        flags.append(f"-DATTN_OPS_TQ_MIN_BLOCKS={min_blocks}")
    if norm_mma:
        flags.append("-DATTN_OPS_TQ_NORM_MMA")
    return load_extension(_SOURCE, "attn_ops_turboquant_decode", flags)


@functools.cache
def cuda_decode_built(min_blocks: int = 0, norm_mma: bool = False) -> bool:
    """Whether the kernels build for ``min_blocks`` and ``norm_mma`` (:func:`_module`,
    :func:`build_of`; once a process). A failed build is logged once with its reason, and the
    decode steps stay on TRITON_ATTN's kernels."""
    return build_or_report(lambda: _module(min_blocks, norm_mma), "TurboQuant's CUDA decode",
                           "its uniform decode steps run on TRITON_ATTN's kernels",
                           "triton.turboquant_cuda_decode")


_SPLIT_COST = 4  # (a CTA's own work -- key table, query, partials -- in a warp's 16-key steps)


@functools.lru_cache(maxsize=4096)  # (a loop over the split counts: once a shape, not a step)
def _splits(rows: int, kv_heads: int, capacity: int, slots: int,
            split_keys: int) -> tuple[int, int]:
    """``(splits, keys a split)``: of the split counts leaving each split at least
    ``split_keys`` of the table's ``capacity`` (``Tuning.triton.turboquant_cuda_split_keys``),
    the one of the least time, in waves of the device's ``slots`` (CTAs an SM x SMs) over the
    step's (request, KV head) pairs x (a warp's steps a split + a CTA's own work); the fewest
    splits of equal time. (A last wave a third full costs a whole wave.)"""
    pairs = max(1, rows * kv_heads)

    def time(s: int) -> int:
        return -(-pairs * s // slots) * (-(-capacity // (64 * s)) + _SPLIT_COST)

    splits = min(range(1, max(1, capacity // split_keys) + 1), key=lambda s: (time(s), s))
    keys = -(-capacity // splits)
    return splits, -(-keys // 64) * 64


@functools.cache
def _slots(device: torch.device, d: int, bf16: bool, key_bits: int, value_bits: int,
           build: tuple[int, bool]) -> int:
    """The decode's CTAs ``device`` runs at once in ``build``: its occupancy x the SMs."""
    from attn_ops.routing import DeviceFacts

    blocks = _module(*build).blocks_per_sm(device.index if device.index is not None else 0, d,
                                           bf16, key_bits, value_bits)
    return max(1, blocks) * DeviceFacts.of(device).num_sms


def turboquant_cuda_decode(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse,
                           scale: float, preset, codebook: torch.Tensor, tuning=None) -> None:
    """``out [rows, Hq, D]`` (and ``lse [rows, Hq]``, natural log) of a uniform decode step
    over a TurboQuant cache, row ``i`` request ``i``'s query; rows from
    ``query_start_loc[-1]`` on (a padded batch's) and rows without keys zero (inputs already
    checked; see :func:`cuda_decode_serves`), under ``tuning`` (a
    :class:`~attn_ops.tuning.Tuning`; default: this machine's)."""
    from attn_ops.backends.turboquant.format import hadamard
    from attn_ops.tuning import default_tuning

    rows, heads, d = query.shape
    kv_heads, page = kv_cache.shape[1], kv_cache.shape[2]
    if rows == 0:
        return
    t = (tuning or default_tuning()).triton
    fp8_keys = preset.fp8_keys
    low = torch.float16 if fp8_keys or query.dtype == torch.float16 else torch.bfloat16
    # (3- and 4-bit keys: the query rotated, here or -- turboquant_cuda_fused_rotation -- in
    # the kernel, three launches fewer)
    fused = not fp8_keys and t.turboquant_cuda_fused_rotation
    q_in = query if fp8_keys or fused else query.float() @ hadamard(d, query.device)
    q_in = q_in.to(low).contiguous()
    build = build_of(t)
    slots = _slots(query.device, d, low == torch.bfloat16, preset.key_bits, preset.value_bits,
                   build)
    splits, keys = _splits(rows, kv_heads, block_table.shape[1] * page, slots,
                           t.turboquant_cuda_split_keys)
    parts = splits * _WARPS
    part_out = torch.empty(rows, heads, parts, d, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(rows, heads, parts, dtype=torch.float32, device=query.device)
    module = _module(*build)
    module.decode(q_in, kv_cache, block_table.int().contiguous(), seq_lens.int().contiguous(),
                  codebook.float().contiguous(), part_out, part_lse, splits, keys, float(scale),
                  preset.key_bits, preset.value_bits, fused)
    module.combine(part_out, part_lse, query_start_loc.int().contiguous(), out, lse)
