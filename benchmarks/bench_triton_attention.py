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

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_attention import (Batch, check_outputs, decode_bytes,  # noqa: E402
                                 flashinfer_direct, gpu_parser, ours, prefill_flops,
                                 time_graph, timed_fields, write_result)

DECODE = [(b, 32768) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)] + \
    [(b, c) for c in (1024, 8192) for b in (1, 8, 64, 256)]
PREFILL = [(1, s) for s in (1024, 4096, 8192, 16384)]


def measure(kind: str, b: Batch, fns: dict, rounds: int, amount: float, unit: str,
            **shape) -> dict:
    """One point: outputs checked against FlashInfer's, contenders timed, a result row."""
    diff = check_outputs(b, fns, "flashinfer")["triton"]
    ms = time_graph(fns, rounds)
    row = {"kind": kind, **shape, "max_abs_diff": diff, **timed_fields(ms, amount, unit)}
    label = " ".join(f"{k}={v}" for k, v in shape.items())
    shown = {"tbs": "{:.2f}TB/s", "tflops": "{:.0f}TFLOP/s"}[unit]
    print(f"{kind:7s} {label:18s} " + "  ".join(
        f"{k} {row[k + '_ms'] * 1e3:.1f}us " + shown.format(row[f"{k}_{unit}"]) for k in ms)
        + f"  triton/flashinfer {ms['flashinfer'] / ms['triton']:.2f}  diff {diff:.2g}",
        flush=True)
    return row


def main() -> None:
    args = gpu_parser(__doc__, "bench_triton_attention_h200.json", page=16,
                      rounds=2).parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bsz, ctx in ([(1, 4096), (64, 4096)] if args.quick else DECODE):
        b = Batch(bsz, ctx, 1, args.page, gen)
        fns = {"triton": ours(b, "TRITON_ATTN"), "flashinfer": flashinfer_direct(b, False),
               "flashinfer_tc": flashinfer_direct(b, False, tensor_cores=True)}
        rows.append(measure("decode", b, fns, args.rounds, decode_bytes(bsz, ctx), "tbs",
                            batch=bsz, ctx=ctx))
        del b, fns
    for bsz, s in ([(1, 4096)] if args.quick else PREFILL):
        b = Batch(bsz, s, s, args.page, gen)
        fns = {"triton": ours(b, "TRITON_ATTN"), "flashinfer": flashinfer_direct(b, True)}
        rows.append(measure("prefill", b, fns, args.rounds, prefill_flops(bsz, s), "tflops",
                            batch=bsz, seq=s))
        del b, fns
    write_result("bench_triton_attention", args.out, quick=args.quick, page=args.page,
                 rows=rows, method="median over rotating rounds of do_bench_cudagraph medians")

if __name__ == "__main__":
    main()
