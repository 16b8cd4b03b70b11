"""TRITON_ATTN (our Triton kernels, through ``torch.ops.attn.triton_attention``) against
FlashInfer called directly, on the same paged cache and batch (H200 shapes of issue 4: bf16,
32 query / 8 KV heads, head dim 128, page 16, pages in random order).

Decode: batch 1-256 at ctx 32k (latency must not jump up as the batch grows: the split-KV
cliff users hit in vLLM's Triton backend) and batch 1/8/64/256 at ctx 1k and 8k. Prefill:
causal 1x1k .. 1x16k. Same method as ``bench_gpu_attention.py`` (CUDA-graph replays, rotating
rounds, medians); prints time, TB/s or TFLOP/s and the ratio to FlashInfer, writes JSON.

    python benchmarks/bench_triton_attention.py [--quick] [--page N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_info  # noqa: E402
from bench_gpu_attention import (D, HKV, HQ, Batch, flashinfer_direct, ours,  # noqa: E402
                                 time_graph)

DECODE = [(b, 32768) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)] + \
    [(b, c) for c in (1024, 8192) for b in (1, 8, 64, 256)]
PREFILL = [(1, s) for s in (1024, 4096, 8192, 16384)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "bench_triton_attention_h200.json"))
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    decode = [(1, 4096), (64, 4096)] if args.quick else DECODE
    for bsz, ctx in decode:
        b = Batch(bsz, ctx, 1, args.page, gen)
        fns = {"triton": ours(b, "TRITON_ATTN"), "flashinfer": flashinfer_direct(b, False),
               "flashinfer_tc": flashinfer_direct(b, False, tensor_cores=True)}
        fns["flashinfer"]()
        truth = b.out.float().clone()
        fns["triton"]()
        diff = (b.out.float() - truth).abs().max().item()
        ms = time_graph(fns, args.rounds)
        nbytes = bsz * ctx * HKV * D * 2 * 2
        r = {"kind": "decode", "batch": bsz, "ctx": ctx, "max_abs_diff": diff,
             **{f"{k}_ms": v for k, v in ms.items()},
             **{f"{k}_tbs": nbytes / v / 1e9 for k, v in ms.items()}}
        rows.append(r)
        print(f"decode  B={bsz:<4} ctx={ctx:<6} " + "  ".join(
            f"{k} {r[k + '_ms'] * 1e3:.1f}us {r[k + '_tbs']:.2f}TB/s" for k in ms)
            + f"  triton/flashinfer {ms['flashinfer'] / ms['triton']:.2f}  diff {diff:.2g}",
            flush=True)
        del b, fns
    for bsz, s in ([(1, 4096)] if args.quick else PREFILL):
        b = Batch(bsz, s, s, args.page, gen)
        fns = {"triton": ours(b, "TRITON_ATTN"), "flashinfer": flashinfer_direct(b, True)}
        fns["flashinfer"]()
        truth = b.out.float().clone()
        fns["triton"]()
        diff = (b.out.float() - truth).abs().max().item()
        ms = time_graph(fns, args.rounds)
        flops = 4 * bsz * s * s * HQ * D / 2
        r = {"kind": "prefill", "batch": bsz, "seq": s, "max_abs_diff": diff,
             **{f"{k}_ms": v for k, v in ms.items()},
             **{f"{k}_tflops": flops / v / 1e9 for k, v in ms.items()}}
        rows.append(r)
        print(f"prefill {bsz}x{s:<6} " + "  ".join(
            f"{k} {r[k + '_tflops']:.0f}TFLOP/s" for k in ms)
            + f"  triton/flashinfer {ms['flashinfer'] / ms['triton']:.2f}  diff {diff:.2g}",
            flush=True)
        del b, fns
    info = run_info("bench_triton_attention")
    info.update(device=torch.cuda.get_device_name(), quick=args.quick, page=args.page,
                rows=rows, method="median over rotating rounds of do_bench_cudagraph medians")
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
