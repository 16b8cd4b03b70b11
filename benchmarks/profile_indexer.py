"""Where the sparse-MLA indexer's top-k spends its time on the GPU: the CUDA time of each
launch (scoring, the select's histograms, counts and write; ``torch.profiler``) at
DeepSeek-V3.2's sizes (64 heads x 128, top-k 2048, page 64, fp8 keys with one scale a token,
bf16 queries), per case of rows x context, beside the case's key-bytes floor.

    python benchmarks/profile_indexer.py [--cases 1x131072 128x32768 4096x4096 ...]
"""

from __future__ import annotations

import argparse

import torch


def case(rows: int, ctx: int, page: int = 64, heads: int = 64, dim: int = 128):
    """A decode-like step: ``rows`` requests of one query row each at context ``ctx`` (a
    single prefill of ``rows`` tokens ending at ``ctx`` when ``rows > 1`` and ``ctx <=
    rows``)."""
    from attn_ops.backends.mla.indexer import FP8, allocate_index_cache

    dev = "cuda"
    prefill = ctx <= rows
    reqs = 1 if prefill else rows
    pages = -(-ctx // page)
    keys, scales = allocate_index_cache(reqs * pages, page, dim, FP8, device=dev)
    keys.copy_(torch.randn(keys.shape, device=dev).to(FP8))
    scales.copy_(torch.rand(scales.shape, device=dev) + 0.05)
    table = torch.randperm(reqs * pages, device=dev).view(reqs, pages).to(torch.int32)
    seq = torch.full((reqs,), ctx, dtype=torch.int32, device=dev)
    per = rows if prefill else 1
    qsl = torch.arange(reqs + 1, device=dev, dtype=torch.int32) * per
    q = torch.randn(rows, heads, dim, device=dev, dtype=torch.bfloat16)
    w = torch.randn(rows, heads, device=dev) / heads
    key_bytes = reqs * ctx * (dim + 4) if not prefill else ctx * (dim + 4)
    return (q, w, keys, scales, table, seq, qsl), key_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+",
                        default=["1x131072", "8x32768", "64x32768", "128x32768", "128x131072",
                                 "4096x4096", "16384x16384"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--topk", type=int, default=2048,
                        help="2048: DeepSeek-V3.2; 512: DeepSeek-V4's C4A layers")
    args = parser.parse_args()
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from attn_ops.backends.mla.indexer_kernels import indexer_topk_device

    for spec in args.cases:
        rows, ctx = (int(v) for v in spec.split("x"))
        inputs, key_bytes = case(rows, ctx)

        def fn():
            return indexer_topk_device(*inputs, args.topk)

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        found = [(e.key, e.device_time_total / args.iters, e.count // args.iters)
                 for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(t for _, t, _ in found)
        print(f"== {spec}: {total:.1f} us of device time a call; keys {key_bytes / 1e6:.1f} MB"
              f" -> {key_bytes / 4.27e6:.1f} us at 4.27 TB/s")
        for key, t, n in sorted(found, key=lambda r: -r[1])[:8]:
            print(f"   {t:9.1f} us  x{n:<3d} {key[:80]}")
        # each launch of a call in its order (the select's passes share one kernel name)
        launches = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                          key=lambda e: e.time_range.start)
        per = len(launches) // args.iters
        if per * args.iters == len(launches):
            steps = []
            for i in range(per):
                us = sum(launches[k * per + i].time_range.elapsed_us()
                         for k in range(args.iters)) / args.iters
                steps.append(f"{launches[i].name.split('(')[0][:20]} {us:.1f} us")
            print("    in order: " + ", ".join(steps))

if __name__ == "__main__":
    main()
