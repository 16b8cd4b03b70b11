"""CPU_ATTN: the fast CPU path -- a C kernel that reads the paged KV cache in place.

Design. Gathering pages into dense tensors and calling a dense kernel costs a dozen small torch
ops per request, and on CPU each costs microseconds: at decode sizes that overhead, not the
arithmetic, is the time. So CPU_ATTN is one call into a small C kernel
(``cpu_attn_kernels.c``) for the whole mixed batch. For every (request, KV head, chunk of query
tokens) it packs the query rows of all query heads sharing that KV head (GQA/MQA read K/V once),
walks only the request's visible keys page by page straight from the cache -- a sliding window
skips whole pages, unused and NaN-poisoned slots are never touched, and a key whose block id is
outside the cache is absent (never read, out of the softmax) -- converts each K/V row to
float once (fp32, fp16, bf16, or fp8 e4m3/e5m2 through a table with the per-tensor scale folded
in), and runs an online softmax in float32 with soft-cap, ALiBi, sinks and the natural-log LSE
of REFERENCE. Work items are spread over ``torch.get_num_threads()`` threads.

The kernel is plain C (no torch headers), compiled on first use with the system C compiler in
about a second and cached under ``$ATTN_OPS_CACHE_DIR`` (default ``~/.cache/attn_ops``). A
machine without a C compiler gets a reason, not an import error.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, HeadDims, Reason
from attn_ops.ops import (PAGED_ATTENTION_SCHEMA, check_paged_attention_inputs,
                          check_paged_attention_values, debug_checks_enabled, define_op)
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.spec import (AttentionSpec, AttentionType, Feature, KVCacheDType,
                           TURBOQUANT_KV_DTYPES)

__all__ = ["CPUAttnBackend", "cpu_paged_attention"]

_SOURCE = Path(__file__).with_name("cpu_attn_kernels.c")
_CFLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno",
           "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")
_CACHE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3,
               torch.float8_e5m2: 3}


class _Args(ctypes.Structure):
    """Mirror of ``Args`` in cpu_attn_kernels.c (same field order and types)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_st", ctypes.c_int64), ("q_sh", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("c_sb", ctypes.c_int64), ("c_st", ctypes.c_int64), ("c_sh", ctypes.c_int64),
        ("cache_kind", ctypes.c_int), ("lut", ctypes.c_void_p),
        ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
        ("block_table", ctypes.c_void_p), ("bt_stride", ctypes.c_int64),
        ("qsl", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p), ("num_reqs", ctypes.c_int),
        ("out", ctypes.c_void_p), ("o_st", ctypes.c_int64), ("o_sh", ctypes.c_int64),
        ("lse", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("alibi", ctypes.c_void_p),
        ("hq", ctypes.c_int), ("hkv", ctypes.c_int), ("d", ctypes.c_int), ("dv", ctypes.c_int),
        ("block_size", ctypes.c_int), ("scale", ctypes.c_float), ("soft_cap", ctypes.c_float),
        ("window", ctypes.c_int), ("causal", ctypes.c_int),
        ("num_blocks", ctypes.c_int64), ("bt_width", ctypes.c_int64),
    ]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.cache
def _kernel():
    """Compile (once per source, flags, compiler and CPU) and load the C kernel."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("CPU_ATTN needs a C compiler to build its kernel; install gcc or set "
                           "CC")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    from attn_ops.platforms import current_platform

    key = hashlib.sha256("\n".join([_SOURCE.read_text(), " ".join(_CFLAGS), version,
                                    platform.machine(), current_platform().device_name])
                         .encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("ATTN_OPS_CACHE_DIR", Path.home() / ".cache" / "attn_ops"))
    library = cache_dir / f"cpu_attn_{key}.so"
    if not library.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        result = subprocess.run([cc, *_CFLAGS, str(_SOURCE), "-o", tmp, "-lm"],
                                capture_output=True, text=True)
        if result.returncode:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{result.stderr}")
        os.replace(tmp, library)  # atomic: concurrent processes see a whole file or none
    lib = ctypes.CDLL(str(library))
    fn = lib.attn_ops_cpu_paged_attention
    fn.argtypes = [ctypes.POINTER(_Args), ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """float32 value of each of the 256 bit patterns of an fp8 dtype."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def _int32(t: torch.Tensor) -> torch.Tensor:
    t = t if t.dtype == torch.int32 else t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def cpu_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
                        alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap,
                        causal) -> None:
    """The CPU_ATTN kernel (schema: :data:`attn_ops.ops.PAGED_ATTENTION_SCHEMA`)."""
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    head_dim_v = out.shape[2]
    # K and V as (address, strides) without building views (this runs in every layer):
    # NHD [blocks, 2, block_size, Hkv, D] or NHD_PACKED [blocks, block_size, Hkv, D + Dv].
    packed = kv_cache.dim() == 4
    st = kv_cache.stride()
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1 if packed else 2]
    num_kv_heads = kv_cache.shape[2 if packed else 3]
    block_stride, token_stride, head_stride = (st[0], st[1], st[2]) if packed else \
        (st[0], st[2], st[3])
    k_addr = kv_cache.data_ptr()
    v_addr = k_addr + kv_cache.element_size() * (head_dim if packed else st[1])
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_paged_attention_values(num_tokens, num_blocks, block_size, starts, lens,
                                 block_table, debug_checks_enabled())
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"CPU_ATTN computes fp32/fp16/bf16, got query.dtype={query.dtype}; "
                         "use REFERENCE for float64")
    if st[-1] != 1:
        raise ValueError(f"CPU_ATTN needs a KV cache with contiguous head dims, got strides {st}; "
                         "allocate the cache with attn_ops.allocate_kv_cache")
    q = query if query.dtype == torch.float32 and query.stride(2) == 1 else query.float()
    direct = out.dtype == torch.float32 and out.stride(2) == 1
    o = out if direct else torch.empty(out.shape, dtype=torch.float32)
    direct_lse = lse is None or lse.is_contiguous()
    lse_buf = lse if direct_lse else torch.empty(lse.shape, dtype=torch.float32)
    qsl, seq, table = _int32(query_start_loc), _int32(seq_lens), _int32(block_table)
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    lut = _fp8_table(kv_cache.dtype) if fp8 else None
    sinks_f = sinks.float().contiguous() if sinks is not None else None
    slopes_f = alibi_slopes.float().contiguous() if alibi_slopes is not None else None

    def ptr(t):
        return t.data_ptr() if t is not None else None

    args = _Args(
        ptr(q), q.stride(0), q.stride(1), k_addr, v_addr, block_stride, token_stride,
        head_stride, _CACHE_KIND[kv_cache.dtype], ptr(lut),
        float(k_scale) if fp8 else 1.0, float(v_scale) if fp8 else 1.0, ptr(table),
        table.stride(0), ptr(qsl), ptr(seq), len(lens), ptr(o), o.stride(0), o.stride(1),
        ptr(lse_buf), ptr(sinks_f), ptr(slopes_f), num_heads, num_kv_heads, head_dim,
        head_dim_v, block_size, scale, soft_cap or 0.0, sliding_window or 0, int(causal),
        num_blocks, table.shape[1])
    # (the kernel treats a block id outside the cache, or a key past the table's row, as
    # absent: block ids come from a tensor and are never trusted)
    rc = _kernel()(ctypes.byref(args), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"CPU_ATTN kernel failed (code {rc}: "
                           f"{'out of memory' if rc == 1 else 'bad arguments'})")
    if starts[-1] < num_tokens:  # padding rows
        o[starts[-1]:].zero_()
        if lse_buf is not None:
            lse_buf[starts[-1]:].zero_()
    if not direct:
        out.copy_(o)
    if not direct_lse:
        lse.copy_(lse_buf)


def _fake(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
          alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal) -> None:
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)


cpu_attention = define_op("cpu_attention", PAGED_ATTENTION_SCHEMA, cpu_paged_attention, _fake,
                          fp8_output_at=5,
                          dispatch_keys=("CPU",))


class CPUAttnBackend(AttentionBackend):
    """One C-kernel call per batch straight over the paged cache; every REFERENCE feature."""

    name = "CPU_ATTN"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CPU}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dims=HeadDims(multiple_of=1, min=1, max=1024),
        kv_cache_dtypes=frozenset(KVCacheDType) - TURBOQUANT_KV_DTYPES,
        features=frozenset(Feature) - {Feature.MLA, Feature.CROSS_ATTENTION, Feature.CUSTOM_MODS,
                                         Feature.TREE},
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        preferred_block_size=16,
        cudagraph_support=CUDAGraphSupport.NEVER,  # CPU: no CUDA graphs
    )
    op = cpu_attention

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        if platform.kind is PlatformKind.CPU and not platform.simulated and _compiler() is None:
            reasons.append(Reason(cls.name, "compiler_missing",
                                  "no C compiler found to build the CPU_ATTN kernel",
                                  "install gcc (or set CC)"))
        return reasons
