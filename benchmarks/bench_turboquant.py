"""TurboQuant KV on the H200: decode over each preset's cache against bf16 and fp8 caches of the
same keys and values in the same run, and the cache write against the copy bandwidth.

* ``decode`` -- ``--batches`` x ``--ctxs`` (default B = 8, 32, 128 at 8k and 32k), one new
  token a request, 32 query / 8 KV heads of 128, bf16 queries. Contenders: ``bf16`` (the
  backend attn_ops selects for an unquantized cache: COMPOSITE_SM90 on the H200), ``fp8_e4m3``
  (the one it selects for an e4m3 cache, per-tensor scales), ``TURBOQUANT:<preset>`` for each
  preset (our op: its uniform decode steps on the CUDA decode of
  ``backends/turboquant/decode_kernels.cu`` where it builds, ``op_read`` in the JSON),
  ``TURBOQUANT:<preset> triton`` (the same cache read by TRITON_ATTN's kernels), and ``copy``
  (a device copy of the 4bit_nc cache's bytes). Bytes = every slot of
  the context read once (bf16 512 B, fp8 256 B, a preset its slot, a token and KV head) ->
  TB/s. Target: a preset's time <= bf16's x (its slot bytes / 512) x 1.3 (``target_ms``;
  ``meets_target``).
* ``write`` -- ``--write-tokens`` tokens (default 8192) of K and V written into each preset's
  cache (``torch.ops.attn.turboquant_cache_update``, one launch: the CUDA write where it
  serves, the Triton write elsewhere) and into a bf16 cache
  (``kv_cache_update``); bytes = the K/V read (bf16) + the slots written, against a copy of the
  same bytes.

Cross-checks before timing: each preset's output (and fp8's) against REFERENCE in fp32 over
the keys and values its cache reads back as, in fp32 (the format's dequantization, the same
attention; fp8: its codes times their scales): they must agree to the contender's own bf16
rounding (``TOLERANCE``), else its row prints "mismatch" and gets no ratio. The
fp8 and preset outputs' SQNR against the bf16 output of the unquantized cache is reported (the
format's error, not a check).

Timing: CUDA-graph replays (device time) and eager calls (the host's launch work counts where
it is slower), contenders interleaved over ``--rounds``, medians.

    python benchmarks/bench_turboquant.py [--only decode write] [--batches 8 32 128]
        [--ctxs 8192 32768] [--write-tokens 8192] [--rounds 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (check_text, cross_check, run_info, time_graph_and_eager,  # noqa: E402
                     write_json)

HQ, HK, D = 32, 8, 128
BF16 = torch.bfloat16  # (the queries' and unquantized caches' dtype: fp32 with --quick)
DEVICE = "cuda"  # (--quick: the CPU, timings left out)
PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
TOLERANCE = 2e-2  # max |a - b| / max |b|: a bf16 computation against the exact one
TARGET_SLACK = 1.3


def _layer(kv_dtype: str, block_size: int | None = None, reference: bool = False):
    """The selected layer; ``reference``: REFERENCE in fp32 (the cross-check's oracle)."""
    from attn_ops import Attention, AttentionConfig, AttentionSpec

    spec = AttentionSpec(num_heads=HQ, num_kv_heads=HK, head_dim=D,
                         dtype=torch.float32 if reference else BF16,
                         kv_cache_dtype=kv_dtype, block_size=block_size)
    return Attention(spec, AttentionConfig(backend="REFERENCE") if reference else None
                     ).to(DEVICE)


def _timings(fns, rounds):
    """CUDA-graph and eager medians; none on the CPU (--quick: the script's logic only)."""
    if DEVICE == "cpu":
        for fn in fns.values():
            fn()
        return {}, {}, {}
    return time_graph_and_eager(fns, rounds)


def decode_point(batch: int, ctx: int, rounds: int) -> dict:
    from attn_ops import BlockAllocator, build_batch, build_step_metadata
    from attn_ops.backends.turboquant.ops import turboquant_dense_cache
    from attn_ops.kv_cache import split_kv_cache
    from attn_ops.testing import sqnr_db

    g = torch.Generator(device=DEVICE).manual_seed(batch * 7 + ctx)
    k = torch.randn(batch * ctx, HK, D, generator=g, device=DEVICE, dtype=BF16)
    v = torch.randn(batch * ctx, HK, D, generator=g, device=DEVICE, dtype=BF16)
    q = torch.randn(batch, HQ, D, generator=g, device=DEVICE, dtype=BF16)
    names = {"bf16": "auto", "fp8_e4m3": "fp8_e4m3",
             **{f"TURBOQUANT:{p.removeprefix('turboquant_')}": p for p in PRESETS}}
    fns, outs, bytes_, layers, metas = {}, {}, {}, {}, {}
    for name, kv_dtype in names.items():
        layer = _layer(kv_dtype)
        if kv_dtype == "fp8_e4m3":
            layer.k_scale.fill_(float(k.abs().max()) / 448)
            layer.v_scale.fill_(float(v.abs().max()) / 448)
        page = layer.block_size
        blocks = batch * -(-ctx // page) + 1
        alloc = BlockAllocator(blocks, page)
        cache = layer.allocate_kv_cache(blocks)
        ids = list(range(batch))
        fill = build_batch(alloc, ids, [0] * batch, [ctx - 1] * batch, device=DEVICE)
        rows = torch.cat([torch.arange(i * ctx, (i + 1) * ctx - 1) for i in ids]).to(DEVICE)
        layer(q.new_zeros(rows.shape[0], HQ, D), k[rows], v[rows], cache, fill)
        step = build_batch(alloc, ids, [ctx - 1] * batch, [1] * batch, device=DEVICE)
        last = torch.arange(batch, device=DEVICE) * ctx + ctx - 1
        # the new token's K/V written once; each timed call attends over the whole context
        layer(q, k[last], v[last], cache, step)
        meta = build_step_metadata([(layer._metadata_key, layer.impl)], step)[
            layer._metadata_key]
        out = q.new_empty(batch, HQ, D)

        def call(layer=layer, cache=cache, meta=meta, out=out):
            layer.impl.forward(q, cache, meta, out, k_scale=layer.k_scale,
                               v_scale=layer.v_scale)
            return out

        fns[name], outs[name] = call, call().clone()
        slot = cache.numel() * cache.element_size() / (blocks * page * HK)
        bytes_[name] = batch * ctx * HK * slot
        layers[name], metas[name] = (layer, cache, step), meta
    _triton_read_contender(q, names, fns, outs, bytes_, layers, metas)
    tq = [n for n in names if n.startswith("TURBOQUANT")]
    # a copy moving (read + written) the 4bit_nc slots' bytes: the bandwidth that size gets
    src = torch.empty(int(bytes_["TURBOQUANT:4bit_nc"]) // 4, dtype=BF16, device=DEVICE)
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)
    bytes_["copy"] = 2 * src.numel() * src.element_size()
    checks, sqnr = {}, {}
    for name in [*tq, "fp8_e4m3"]:  # REFERENCE in fp32 over the keys and values the cache
        # reads back as (exact: the contender's own bf16 rounding is all the error left)
        sqnr[name] = sqnr_db(outs[name].float(), outs["bf16"].float())
        layer, cache, step = layers[name]
        if name == "fp8_e4m3":
            dense = torch.empty(cache.shape, dtype=torch.float32, device=DEVICE)
            for part, stored, s in zip(split_kv_cache(dense, D, D), split_kv_cache(cache, D, D),
                                       (layer.k_scale, layer.v_scale)):
                part.copy_(stored.float() * s)
        else:
            dense = turboquant_dense_cache(cache, names[name], D, torch.float32)
        ref = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
        ref_impl = _layer("auto", layer.block_size, reference=True).impl
        ref_impl.forward(q.float(), dense.contiguous(), step, ref)
        checks[name] = cross_check(outs[name].float(), ref, TOLERANCE)
    graph, eager, errors = _timings(fns, rounds)
    row = {"batch": batch, "ctx": ctx, "graph_ms": graph, "eager_ms": eager, "bytes": bytes_,
           "graph_tbs": {n: bytes_[n] / t / 1e9 for n, t in graph.items()},
           "cross_check": checks, "sqnr_db_vs_bf16": sqnr, "errors": errors,
           "backends": {n: layers[n][0].backend for n in layers}}
    bf16 = graph.get("bf16")
    row["target_ms"] = {n: bf16 * bytes_[n] / bytes_["bf16"] * TARGET_SLACK
                        for n in tq if bf16}
    row["meets_target"] = {n: checks[n]["agree"] and graph.get(n, math.inf) <= row["target_ms"][n]
                           for n in row["target_ms"]}
    row["speedup_vs_bf16"] = {n: (bf16 / graph[n] if checks.get(n, {}).get("agree", True)
                                  else None) for n in graph if bf16 and n != "copy"}
    for n in fns:
        g_ms, e_ms = graph.get(n), eager.get(n)
        print(f"decode B={batch:4d} ctx={ctx:6d} {n:24s} graph "
              + (f"{g_ms * 1e3:8.1f} us {bytes_[n] / g_ms / 1e9:5.2f} TB/s" if g_ms else "-")
              + " | eager " + (f"{e_ms * 1e3:8.1f} us" if e_ms else "-")
              + (f" | {check_text(checks[n])}" if n in checks else "")
              + (f" | SQNR vs bf16 {sqnr[n]:.1f} dB" if n in sqnr else "")
              + (f" | {row['speedup_vs_bf16'][n]:.2f}x bf16" if row["speedup_vs_bf16"].get(n)
                 else "")
              + (f" | target {row['target_ms'][n] * 1e3:.1f} us "
                 f"{'met' if row['meets_target'][n] else 'MISSED'}" if n in row["target_ms"]
                 else ""), flush=True)
    for n, e in errors.items():
        print(f"decode B={batch} ctx={ctx} {n}: {e}", flush=True)
    return row


def _op_read() -> str:
    """Which read the op's uniform decode steps take here: "cuda" (the CUDA decode, built) or
    "triton"."""
    from attn_ops.backends.turboquant.cuda_decode import build_of, cuda_decode_built
    from attn_ops.tuning import default_tuning

    triton = default_tuning().triton
    on = DEVICE == "cuda" and triton.turboquant_cuda_decode
    return "cuda" if on and cuda_decode_built(*build_of(triton)) else "triton"


def _triton_read_contender(q, names, fns, outs, bytes_, layers, metas) -> None:
    """``TURBOQUANT:<preset> triton`` for every preset: its layer's cache and step read by
    TRITON_ATTN's kernels (the op's read where the CUDA decode is off or does not build); none
    on the CPU (--quick: the op's torch body there)."""
    from attn_ops.backends.turboquant.ops import triton_turboquant_attention

    if DEVICE != "cuda":
        return
    for base in [n for n in names if n.startswith("TURBOQUANT")]:
        layer, cache, step = layers[base]
        out = torch.empty_like(q)
        args = layer.impl.op_arguments(q, cache, metas[base], out)

        def call(args=args, out=out):
            triton_turboquant_attention(*args, cuda_decode=False)
            return out

        name = f"{base} triton"
        fns[name], outs[name] = call, call().clone()
        bytes_[name], layers[name], names[name] = bytes_[base], layers[base], names[base]


def write_point(tokens: int, rounds: int) -> dict:
    from attn_ops import AttentionSpec
    from attn_ops.backends.turboquant.ops import turboquant_cache_update
    from attn_ops.kv_cache import allocate_kv_cache, kv_cache_update

    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    k = torch.randn(tokens, HK, D, generator=g, device=DEVICE, dtype=BF16)
    v = torch.randn(tokens, HK, D, generator=g, device=DEVICE, dtype=BF16)
    slots = torch.randperm(tokens * 2, device=DEVICE)[:tokens].sort().values
    fns, bytes_ = {}, {}
    for kv_dtype in ("auto", *PRESETS):
        spec = AttentionSpec(num_heads=HQ, num_kv_heads=HK, head_dim=D, dtype=BF16,
                             kv_cache_dtype=kv_dtype)
        cache = allocate_kv_cache(spec, tokens * 2 // 16, 16, DEVICE)
        slot = cache.numel() * cache.element_size() / (cache.shape[0] * 16 * HK)
        if kv_dtype == "auto":
            fns["bf16"] = lambda c=cache: kv_cache_update(k, v, c, slots, None, None)
            bytes_["bf16"] = tokens * HK * (2 * D * 2 + slot)
        else:
            name = kv_dtype.removeprefix("turboquant_")
            fns[name] = lambda c=cache, d=kv_dtype: turboquant_cache_update(k, v, c, slots, d)
            bytes_[name] = tokens * HK * (2 * D * 2 + slot)
    src = torch.empty(int(bytes_["4bit_nc"]) // 4, dtype=torch.float16, device=DEVICE)
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)
    bytes_["copy"] = 2 * src.numel() * src.element_size()
    graph, eager, errors = _timings(fns, rounds)
    copy_tbs = bytes_["copy"] / graph["copy"] / 1e9 if "copy" in graph else None
    row = {"tokens": tokens, "graph_ms": graph, "eager_ms": eager, "bytes": bytes_,
           "graph_tbs": {n: bytes_[n] / t / 1e9 for n, t in graph.items()}, "errors": errors}
    row["fraction_of_copy"] = {n: row["graph_tbs"][n] / copy_tbs for n in graph if copy_tbs}
    for n in fns:
        if n in graph:
            print(f"write  T={tokens:6d} {n:12s} graph {graph[n] * 1e3:8.1f} us "
                  f"{row['graph_tbs'][n]:5.2f} TB/s ({row['fraction_of_copy'].get(n, 0):.0%} "
                  f"of copy) | eager {eager.get(n, math.nan) * 1e3:8.1f} us", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=["decode", "write"])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--ctxs", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--write-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="the CPU, fp32, tiny shapes, no timings (keeps the script working)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "bench_turboquant_h200.json"))
    args = parser.parse_args()
    global DEVICE, BF16
    if args.quick:
        DEVICE, BF16 = "cpu", torch.float32
        args.batches, args.ctxs, args.write_tokens, args.rounds = [2], [40], 64, 1
    info = run_info("bench_turboquant")
    info.update(quick=args.quick, device=torch.cuda.get_device_name() if DEVICE == "cuda"
                else "cpu", tolerance=TOLERANCE,
                target_slack=TARGET_SLACK, op_read=_op_read(), decode=[], write=[])
    if "decode" in args.only:
        for ctx in args.ctxs:
            for batch in args.batches:
                try:
                    info["decode"].append(decode_point(batch, ctx, args.rounds))
                except Exception as e:  # noqa: BLE001 -- a failed point is a result
                    info["decode"].append({"batch": batch, "ctx": ctx,
                                           "failed": f"{type(e).__name__}: {str(e)[:300]}"})
                    print(f"decode B={batch} ctx={ctx}: failed: {e}", flush=True)
                torch.cuda.empty_cache()
                write_json(args.out, info)
    if "write" in args.only:
        info["write"].append(write_point(args.write_tokens, args.rounds))
    write_json(args.out, info)


if __name__ == "__main__":
    main()
