"""Where an eager attention call's host time goes (H200): our layers of the call peeled one by
one, next to FlashInfer's wrapper called directly -- the goal "at most 10 us per layer over the
library, eagerly".

Per decode batch (bf16, 32/8 heads, head dim 128, page 128), host microseconds per call, calls
issued back to back without synchronizing (so the host, not the GPU, is timed while the launch
queue has room), and the GPU time of one call (a CUDA-graph replay) beside them:

* ``selected.forward``   -- ``AttentionBackend.forward`` of the selected backend (COMPOSITE_SM90
  on the H200);
* ``flashinfer.forward`` -- the same for FLASHINFER;
* ``torch.ops``          -- ``torch.ops.attn.flashinfer_attention`` with prepared arguments;
* ``op body``            -- its Python implementation called directly (no dispatcher);
* ``paged_run``          -- FlashInfer's C++ entry point alone, with our plan's arguments;
* ``direct``             -- FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.run`` (the
  tensor-core decode our op runs), planned the same way.

Every contender's output is cross-checked against ``direct``'s first (a contender that
disagrees is reported as MISMATCH and listed in the row); FlashInfer's wrapper is called by
keyword. Then a cProfile of ``flashinfer.forward`` (the Python functions with the most own
time).

    python benchmarks/profile_eager_op.py [--out PATH]
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_us  # noqa: E402
from bench_gpu_attention import (D, DTYPE, HKV, HQ, SPEC, Batch,  # noqa: E402
                                 check_outputs, gpu_parser, mismatches, time_graph,
                                 write_result)


def host_per_call_us(fn, n=200) -> float:
    """Host microseconds per call, ``n`` calls back to back (the GPU runs behind while the host
    issues)."""
    torch.cuda.synchronize()
    host = host_us(fn, n, warmup=20)
    torch.cuda.synchronize()
    return host


def contenders(b: Batch) -> dict:
    import flashinfer

    from attn_ops import get_backend_class, select_backend
    from attn_ops.backends import flashinfer as fi
    from attn_ops.backends.flashinfer_plan import (PART, flashinfer_module, paged_kv_csr,
                                                   part_tables)
    from attn_ops.routing import Kernel

    selected = select_backend(SPEC).backend_cls(SPEC)
    fib = get_backend_class("FLASHINFER")(SPEC)
    sel_meta, fi_meta = selected.build_metadata(b.meta), fib.build_metadata(b.meta)
    args = fib.op_arguments(b.q, b.cache, fi_meta, b.out)
    part = PART.decode(fi_meta.decode_plan)  # (the whole batch: a decode part)
    qo, kv_indptr, last, kv_indices = part_tables(fi_meta.tables, fi_meta.seq_lens,
                                                  fi_meta.block_table, part)
    k, v = b.cache.unbind(1)
    mod = flashinfer_module(Kernel.FLASHINFER_FA2, DTYPE, DTYPE, D, D, False, False)
    kernel_plan = list(part.library_plan)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    csr = (x.cuda() for x in paged_kv_csr(b.meta.seq_lens_cpu, b.meta.block_table_cpu, b.page))
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer=ws,
                                                       kv_layout="NHD", backend="fa2")
    indptr, indices, last_len = csr
    w.plan(qo_indptr=b.meta.query_start_loc, paged_kv_indptr=indptr, paged_kv_indices=indices,
           paged_kv_last_page_len=last_len, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D,
           page_size=b.page, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)

    def paged_run():
        # (FlashInfer's compiled module takes positional arguments only: these are the ones
        # our op passes it, and the cross-check below holds its output to the wrapper's)
        mod.paged_run(fi_meta.float_workspace, fi_meta.decode_workspace, kernel_plan, b.q, k, v,
                      qo, kv_indptr, kv_indices, last, b.out,
                      None, 1, 0, -1, True, None, None, None, None, None, None, 0.0,
                      D ** -0.5, None, None, None, 1.0, 1e4, 0, fi_meta.float_workspace.numel())

    return {"selected.forward": lambda: selected.forward(b.q, b.cache, sel_meta, b.out),
            "flashinfer.forward": lambda: fib.forward(b.q, b.cache, fi_meta, b.out),
            "torch.ops": lambda: torch.ops.attn.flashinfer_attention(*args),
            "op body": lambda: fi._flashinfer_attention(*args),
            "paged_run": paged_run,
            "direct": lambda: w.run(q=b.q, paged_kv_cache=b.cache, out=b.out)}, fib, fi_meta


def main() -> None:
    args = gpu_parser(__doc__, "profile_eager_op_h200.json", page=128, rounds=1,
                      quick=False).parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bsz, ctx in ((1, 4096), (64, 4096)):
        b = Batch(bsz, ctx, 1, args.page, gen)
        fns, fib, fi_meta = contenders(b)
        checks = check_outputs(b, fns, "direct")
        bad = mismatches(checks)
        if bad:
            print(f"B={bsz} ctx={ctx}  MISMATCH with FlashInfer's wrapper: {bad}", flush=True)
        host = {name: host_per_call_us(fn) for name, fn in fns.items()}
        gpu = {name: ms * 1e3 for name, ms in time_graph(fns, args.rounds).items()}
        prof = cProfile.Profile()
        with prof:
            for _ in range(500):
                fib.forward(b.q, b.cache, fi_meta, b.out)
        torch.cuda.synchronize()
        stats = pstats.Stats(prof).sort_stats("tottime")
        top = sorted(((f"{func[0].split('/')[-1]}:{func[1]}({func[2]})", row[2] / 500 * 1e6)
                      for func, row in stats.stats.items()), key=lambda x: -x[1])[:15]
        rows.append({"batch": bsz, "ctx": ctx, "host_us": host, "gpu_us": gpu,
                     "cross_check_vs_direct": checks, "mismatch": bad,
                     "cprofile_own_us_per_call": top})
        print(f"B={bsz} ctx={ctx}  host us/call: " + "  ".join(
            f"{k} {v:.1f}" for k, v in host.items()) + "\n  gpu us/call: " + "  ".join(
            f"{k} {v:.1f}" for k, v in gpu.items()), flush=True)
        for name, us in top[:8]:
            print(f"    {us:6.2f} us  {name}", flush=True)
    write_result("profile_eager_op", args.out, rows=rows, page=args.page,
                 method="host: perf_counter over 200 back-to-back calls; gpu: "
                        "do_bench_cudagraph median")


if __name__ == "__main__":
    main()
