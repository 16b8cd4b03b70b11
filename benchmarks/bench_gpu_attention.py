"""Our GPU backends through ``torch.ops.attn.*`` vs the kernel libraries called directly.

FLASHINFER (``torch.ops.attn.flashinfer_attention``) against FlashInfer's own wrappers, and
FLASH_ATTN (``torch.ops.attn.flash_attn_attention``) against FlashAttention 4's
``flash_attn_varlen_func`` with its default ``num_splits=1``. Same paged cache (bf16, NHD, page
16 unless ``--page``, pages in random order), same batch, same GPU, one run.
Both sides are planned before timing and timed as CUDA-graph replays of one call
(``triton.testing.do_bench_cudagraph``), so the comparison is kernel against kernel plus
whatever our op adds inside the graph; eager per-call times (host overhead included) are
reported beside them. Also timed: the host cost of our metadata builder (page-table
conversion + FlashInfer's plan) per step.

Formulas: decode bytes = B * ctx * Hkv * D * 2 (K and V) * 2 bytes -> TB/s;
causal prefill FLOPs = 4 * B * S^2 * Hq * D / 2 -> TFLOP/s.

    python benchmarks/bench_gpu_attention.py [--quick] [--page N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from attn_ops import AttentionSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_info  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_BATCH = (1, 8, 64, 256)
DECODE_CTX = (1024, 4096, 8192, 32768)
PREFILL = ((1, 8192), (4, 4096), (16, 1024))


def make_meta(batch, ctx, query_len, gen):
    """Metadata of a batch of equal requests whose pages are in random order."""
    from attn_ops.metadata import build_common_metadata

    pages = -(-ctx // PAGE)
    num_blocks = batch * pages + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[i * pages:(i + 1) * pages] for i in range(batch)]
    return build_common_metadata([query_len] * batch, [ctx] * batch, tables, PAGE, num_blocks,
                                 device="cuda")


def make_batch(batch, ctx, query_len, gen):
    """A decode-first batch over a random cache sized for it, plus q/out buffers."""
    meta = make_meta(batch, ctx, query_len, gen)
    num_blocks = batch * -(-ctx // PAGE) + 1
    cache = torch.randn(num_blocks, 2, PAGE, HKV, D, dtype=DTYPE, device="cuda")
    q = torch.randn(batch * query_len, HQ, D, dtype=DTYPE, device="cuda")
    return meta, cache, q, torch.empty_like(q)


def direct(meta, cache, q, out, prefill):
    """FlashInfer's own wrapper on the same batch (the anchor)."""
    import flashinfer

    from attn_ops.backends.flashinfer import paged_kv_csr

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    indptr, indices, last = (t.cuda() for t in paged_kv_csr(meta.seq_lens_cpu,
                                                            meta.block_table_cpu, PAGE))
    if prefill:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(meta.query_start_loc, indptr, indices, last, HQ, HKV, D, PAGE, causal=True,
               q_data_type=DTYPE, kv_data_type=DTYPE)
    else:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE)
    return lambda: w.run(q, cache, out=out)


def fa4_direct(meta, cache, q, out):
    """FlashAttention 4 as a user calls it (default num_splits=1)."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    k, v = cache.unbind(1)
    return lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=meta.query_start_loc,
                                          seqused_k=meta.seq_lens, max_seqlen_q=meta.max_query_len,
                                          max_seqlen_k=meta.max_seq_len,
                                          page_table=meta.block_table, causal=True)


def ours(meta, cache, q, out, backend="FLASHINFER"):
    from attn_ops import AttentionSpec, get_backend_class

    impl = get_backend_class(backend)(AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                                    dtype=DTYPE))
    planned = impl.build_metadata(meta)  # FLASH_ATTN may hand small decodes to FlashInfer
    return lambda: impl.forward(q, cache, planned, out), impl


def eager_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def measure(meta, cache, q, out, prefill, with_fa4):
    from triton.testing import do_bench_cudagraph

    mine, _ = ours(meta, cache, q, out)
    mine()
    got = out.clone()
    anchor = direct(meta, cache, q, out, prefill)
    anchor()
    r = {
        "ours_ms": do_bench_cudagraph(mine), "flashinfer_ms": do_bench_cudagraph(anchor),
        "ours_eager_us": eager_us(mine), "flashinfer_eager_us": eager_us(anchor),
        "max_abs_diff_vs_flashinfer": (got.float() - out.float()).abs().max().item(),
    }
    if with_fa4:
        fa, _ = ours(meta, cache, q, out, "FLASH_ATTN")
        fa()
        r["max_abs_diff_fa4_vs_flashinfer"] = (got.float() - out.float()).abs().max().item()
        fa4 = fa4_direct(meta, cache, q, out)
        r.update(ours_fa4_ms=do_bench_cudagraph(fa), fa4_ms=do_bench_cudagraph(fa4),
                 ours_fa4_eager_us=eager_us(fa), fa4_eager_us=eager_us(fa4))
    return r


def plan_host_us(batch, ctx, gen, n=50):
    from attn_ops import AttentionSpec
    from attn_ops.backends.flashinfer import FlashInferBackend

    impl = FlashInferBackend(AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                           dtype=DTYPE))
    from attn_ops.backends import flashinfer as fi

    metas = [make_meta(batch, ctx, 1, gen) for _ in range(3)]
    for m in metas:
        impl.build_metadata(m)
    total = 0.0
    for i in range(n):
        m = metas[i % 3]
        fi._PLANS.pop(m, None)  # plan afresh, as for a new step
        t0 = time.perf_counter()
        impl.build_metadata(m)
        total += time.perf_counter() - t0
    return total / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "bench_gpu_attention_h200.json"))
    args = parser.parse_args()
    global PAGE
    PAGE = args.page
    from attn_ops import current_platform, get_backend_class

    fa4 = not get_backend_class("FLASH_ATTN").not_supported_reasons(
        AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=DTYPE),
        current_platform())
    from attn_ops.backends.flashinfer import warmup

    warmup(AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=DTYPE),
           torch.cuda.get_device_capability()[0])
    gen = torch.Generator().manual_seed(0)
    rows = []
    batches, ctxs = ((1, 64), (4096,)) if args.quick else (DECODE_BATCH, DECODE_CTX)
    for b in batches:
        for ctx in ctxs:
            meta, cache, q, out = make_batch(b, ctx, 1, gen)
            r = measure(meta, cache, q, out, prefill=False, with_fa4=fa4)
            nbytes = b * ctx * HKV * D * 2 * 2
            r.update(kind="decode", batch=b, ctx=ctx, bytes=nbytes,
                     **{k.replace("_ms", "_tbs"): nbytes / v / 1e9 for k, v in list(r.items())
                        if k.endswith("_ms")})
            rows.append(r)
            print(f"decode  B={b:<4} ctx={ctx:<6} " + "  ".join(
                f"{k[:-4]} {v:.2f}" for k, v in r.items() if k.endswith("_tbs")) + " TB/s",
                flush=True)
            del cache
    for b, s in (PREFILL[:1] if args.quick else PREFILL):
        meta, cache, q, out = make_batch(b, s, s, gen)
        r = measure(meta, cache, q, out, prefill=True, with_fa4=fa4)
        flops = 4 * b * s * s * HQ * D / 2
        r.update(kind="prefill", batch=b, seq=s, flops=flops,
                 **{k.replace("_ms", "_tflops"): flops / v / 1e9 for k, v in list(r.items())
                    if k.endswith("_ms")})
        rows.append(r)
        print(f"prefill {b}x{s:<6} " + "  ".join(
            f"{k[:-7]} {v:.0f}" for k, v in r.items() if k.endswith("_tflops")) + " TFLOP/s",
            flush=True)
        del cache
    host = {f"B={b} ctx={c}": plan_host_us(b, c, gen) for b, c in ((256, 4096), (64, 4096))}
    print("metadata builder host time per step (us):", {k: round(v, 1) for k, v in host.items()})
    info = run_info("bench_gpu_attention")
    info.update(device=torch.cuda.get_device_name(), quick=args.quick, page=PAGE, rows=rows,
                builder_host_us=host, method="triton.testing.do_bench_cudagraph medians")
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
