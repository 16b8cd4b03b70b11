"""TurboQuant decode launches alone, to time or profile (Nsight Compute) without the rest of
``bench_turboquant.py``: Llama-3-8B's heads (32 query / 8 KV heads of 128, bf16), ``--batch``
requests (each size given) of ``--ctx`` tokens each, their caches written by the op's write
(no prefill attention); per preset and batch, ``--iters`` eager calls of the op's GPU read
(the CUDA decode of ``decode_kernels.cu`` by default; TRITON_ATTN's kernels under ``--tuning
triton.turboquant_cuda_decode=false``) and their median device time (CUDA events) with the
slot bytes' TB/s, the output first checked against REFERENCE over the cache read back in fp32
(its row says "agree" or "MISMATCH"), so that a tuning variant's time comes with its
correctness.

    python benchmarks/profile_turboquant_decode.py [--presets turboquant_4bit_nc ...]
        [--batch 8 32] [--ctx 8192] [--iters 20] [--tuning "triton.turboquant_decode_tile=..."]
        [--dtype float16]
    ncu --kernel-name regex:tq_decode_kernel --launch-count 1 --section SpeedOfLight \\
        python benchmarks/profile_turboquant_decode.py --iters 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cross_check  # noqa: E402

HQ, HK, D = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["turboquant_4bit_nc",
                                                         "turboquant_k8v4"])
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tuning", default=None, help="ATTN_OPS_TUNING for the run")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="queries and K/V (Triton's interpreter: float16; its bf16 products "
                             "are wrong)")
    args = parser.parse_args()
    if args.tuning is not None:
        os.environ["ATTN_OPS_TUNING"] = args.tuning

    from attn_ops import AttentionSpec, BlockAllocator, build_batch
    from attn_ops.backends.turboquant.backend import TurboQuantBackend
    from attn_ops.backends.reference import reference_paged_attention
    from attn_ops.backends.turboquant.ops import (triton_turboquant_attention,
                                                  turboquant_cache_update,
                                                  turboquant_dense_cache)
    from attn_ops.kv_cache import allocate_kv_cache

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    ctx = args.ctx
    g = torch.Generator(device=dev).manual_seed(0)
    for preset, b in ((p, b) for p in args.presets for b in args.batch):
        spec = AttentionSpec(num_heads=HQ, num_kv_heads=HK, head_dim=D, dtype=dtype,
                             kv_cache_dtype=preset)
        impl = TurboQuantBackend(spec)
        blocks = b * -(-ctx // 16) + 1
        alloc = BlockAllocator(blocks, 16)
        cache = allocate_kv_cache(spec, blocks, 16, dev)
        ids = list(range(b))
        fill = build_batch(alloc, ids, [0] * b, [ctx] * b, device=dev)
        for rows in torch.arange(b * ctx, device=dev).split(1 << 18):  # (the whole context)
            k, v = (torch.randn(rows.shape[0], HK, D, generator=g, device=dev, dtype=dtype)
                    for _ in range(2))
            turboquant_cache_update(k, v, cache, fill.slot_mapping[rows], preset)
        step = build_batch(alloc, ids, [ctx - 1] * b, [1] * b, device=dev)
        plan = impl.build_metadata(step)
        q = torch.randn(b, HQ, D, generator=g, device=dev, dtype=dtype)
        out = torch.empty_like(q)
        call = impl.op_arguments(q, cache, plan, out)
        triton_turboquant_attention(*call)
        ref = torch.empty(out.shape, dtype=torch.float32, device=dev)
        reference_paged_attention(q.float(), turboquant_dense_cache(cache, preset, D),
                                  step.query_start_loc, step.seq_lens, step.block_table, ref,
                                  None, None, None, None, None, D ** -0.5, None, None, True)
        check = cross_check(out.float(), ref, 2e-2)
        verdict = (f"{'agree' if check['agree'] else 'MISMATCH'} "
                   f"(max rel err {check['max_rel_err']:.1e})  [{args.tuning or 'defaults'}]")
        times = []
        for _ in range(args.iters):
            if dev == "cpu":
                triton_turboquant_attention(*call)
                continue
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            triton_turboquant_attention(*call)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        slot_bytes = b * ctx * HK * cache.shape[-1]
        if times:
            us = sorted(times)[len(times) // 2]
            print(f"{preset:22s} B={b} ctx={ctx}: {us:8.1f} us  "
                  f"{slot_bytes / us / 1e6:5.2f} TB/s of slot bytes  {verdict}")
        else:
            print(f"{preset:22s} B={b} ctx={ctx}: {verdict} (no GPU: no time)")


if __name__ == "__main__":
    main()
