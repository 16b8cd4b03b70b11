"""CUDA-graph decode: our op with CUDA-graph metadata against FlashInfer's own CUDA-graph mode.

FlashInfer's CUDA-graph mode plans differently from its eager mode (split-KV always on, the
grid padded to a fixed size per batch size), so the fair anchor for our graph-mode decode is
FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True, use_tensor_cores=True)``
on the same batch; eager-mode planning of both is timed beside it. COMPOSITE_SM90's graph
decode (``flash_attn_graph``, where it runs: sm90 with FA4 and FlashInfer) runs FA4 in its
64-row tile for capture sizes within ``Tuning.composite.graph_fa4_waves`` waves of (request,
KV head) items and FlashInfer's graph decode elsewhere
(``routing.composite_graph_decode_runs_fa4``). TRITON_ATTN's graph decode (``triton_graph``:
its split-KV kernel, split count fixed per capture size) is timed beside them, and FLASHINFER's
graph decode with ``Tuning.flashinfer.graph_one_cta_per_sm`` off (``ours_graph_fi_rule``:
FlashInfer's own graph split rule, two CTAs per SM). Same shapes and method as
``bench_gpu_attention.py``: every output cross-checked against FlashInfer's tensor-core decode
first (a contender that disagrees is printed ``name(MISMATCH)``), graph replays and eager calls
timed, FlashInfer called by keyword.

    python benchmarks/bench_cudagraph_decode.py [--page N] [--out PATH] [--points BxCTX ...]
        [--only NAME ...]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import eager_ms  # noqa: E402
from bench_gpu_attention import (D, DTYPE, HKV, HQ, SPEC, Batch, check_outputs,  # noqa: E402
                                 decode_bytes, flashinfer_direct, gpu_parser, mismatches, ours,
                                 shown, time_graph, tuned, write_result)

POINTS = ((1, 4096), (1, 32768), (4, 1024), (8, 8192), (64, 4096), (256, 8192))


def flashinfer_graph_mode(b: Batch):
    """FlashInfer's own CUDA-graph decode wrapper (fixed buffers, tensor cores)."""
    import flashinfer

    from attn_ops.backends.flashinfer_plan import paged_kv_csr

    indptr, indices, last = (t.cuda() for t in paged_kv_csr(b.meta.seq_lens_cpu,
                                                            b.meta.block_table_cpu, b.page))
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        float_workspace_buffer=ws, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last)
    w.plan(indptr=indptr, indices=indices, last_page_len=last, num_qo_heads=HQ,
           num_kv_heads=HKV, head_dim=D, page_size=b.page, q_data_type=DTYPE,
           kv_data_type=DTYPE)
    return lambda: w.run(q=b.q, paged_kv_cache=b.cache, out=b.out)


def graph_flashinfer_rule(b: Batch):
    """FLASHINFER's graph decode planned with ``graph_one_cta_per_sm`` off: FlashInfer's own
    CUDA-graph split rule, two CTAs per SM."""
    return ours(b, "FLASHINFER", graph=True,
                tuning=tuned(flashinfer={"graph_one_cta_per_sm": False}))


def main() -> None:
    parser = gpu_parser(__doc__, "bench_cudagraph_decode_h200.json", page=128, rounds=3,
                        quick=False)
    parser.add_argument("--points", nargs="+", metavar="BxCTX", help="e.g. 16x1024 (default: "
                        + " ".join(f"{b}x{c}" for b, c in POINTS) + ")")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these contenders only")
    args = parser.parse_args()
    points = [tuple(map(int, p.split("x"))) for p in args.points] if args.points else POINTS
    gen = torch.Generator().manual_seed(0)
    from attn_ops import current_platform, get_backend_class

    def runs(name: str) -> bool:
        return not get_backend_class(name).not_supported_reasons(SPEC, current_platform())

    rows = []
    for bsz, ctx in points:
        b = Batch(bsz, ctx, 1, args.page, gen)
        fns = {"ours_graph": ours(b, "FLASHINFER", graph=True),
               "ours_graph_fi_rule": graph_flashinfer_rule(b),
               "flashinfer_graph": flashinfer_graph_mode(b),
               "ours": ours(b, "FLASHINFER"),
               "flashinfer_tc": flashinfer_direct(b, False, tensor_cores=True)}
        if runs("COMPOSITE_SM90"):
            fns["flash_attn_graph"] = ours(b, "COMPOSITE_SM90", graph=True)
        if runs("TRITON_ATTN"):
            fns["triton_graph"] = ours(b, "TRITON_ATTN", graph=True)
        truth = fns["flashinfer_tc"]
        if args.only:
            fns = {k: v for k, v in fns.items() if k in args.only}
        checks = check_outputs(b, {"flashinfer_tc": truth, **fns}, "flashinfer_tc")
        ms = time_graph(fns, args.rounds)
        nbytes = decode_bytes(bsz, ctx)
        worst = max(c["max_rel_err"] for c in checks.values())
        rows.append({"batch": bsz, "ctx": ctx, "cross_check_vs_flashinfer_tc": checks,
                     "mismatch": mismatches(checks),
                     **{f"{k}_tbs": nbytes / v / 1e9 for k, v in ms.items()},
                     "eager_us": {k: eager_ms(fn) * 1e3 for k, fn in fns.items()}})
        print(f"B={bsz:<4} ctx={ctx:<6} " + "  ".join(
            f"{shown(k, checks)} {nbytes / v / 1e9:.2f}" for k, v in ms.items())
            + f" TB/s (graph; max rel err {worst:.2g}); eager us: " + "  ".join(
                f"{k} {v:.1f}" for k, v in rows[-1]["eager_us"].items()), flush=True)
        del b, fns, truth
    write_result("bench_cudagraph_decode", args.out, page=args.page, rows=rows,
                 method="median over rotating rounds of triton.testing.do_bench_cudagraph")

if __name__ == "__main__":
    main()
