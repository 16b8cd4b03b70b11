"""TRITON_ATTN (our Triton kernels, through ``torch.ops.attn.triton_attention``) and
FLEX_ATTENTION (compiled FlexAttention over the paged cache) against FlashInfer called directly,
on the same paged cache and batch (bf16, 32 query / 8 KV heads, head
dim 128, page 16, pages in random order). At ``FLEX_POINTS`` FLEX_ATTENTION also runs, with
its anchor: compiled ``flex_attention`` on dense tensors holding the same keys (gathered
outside the timing; its timing includes copying the result into the shared output).

Variants are built with this machine's tuning with one field changed (``Tuning.with_``).
``triton``: TRITON_ATTN as tuned by default; ``triton_fused`` / ``triton_two_launches``: with
its split-KV partials always combined by each tile's last split in the same launch
(``triton.fused_combine=True``) / always by a second kernel (``False``); by default it fuses
from ``triton.fused_min_items`` (request, KV head) items on. ``triton_pps16``: with the split
rule aiming at 16 decode programs per SM (``triton.programs_per_sm``, default 8: more splits
where a batch fills 8 per SM unsplit). ``flex`` is FLEX_ATTENTION as tuned by default: decodes
with ``flex.decode_stages`` pipeline stages in FlexAttention's decoding kernel, prefills at
pages under ``GATHER_PAGE`` in its gathered layout (each request's pages copied into pages of
``GATHER_PAGE`` keys first, copy timed). ``flex_default_stages`` (decode): with FlexAttention's
own stage count (``flex.decode_stages=None``); ``flex_paged`` (prefill): straight over the
pages, key tiles of one page (``flex.gather_min_pairs_per_key_gpu=None``).

Decode: batch 1-256 at ctx 32k (latency must not jump up as the batch grows: the split-KV
cliff users hit in vLLM's Triton backend) and batch 1/8/64/256 at ctx 1k and 8k. Prefill:
causal 1x1k .. 1x16k. Same method as ``bench_gpu_attention.py`` (CUDA-graph replays, rotating
rounds, medians, eager calls back to back beside them in ``eager_us``; every output
cross-checked against FlashInfer's first); prints time, TB/s or
TFLOP/s and the ratio to FlashInfer -- "mismatch" instead where the outputs disagreed -- and
writes JSON. Anchors are called by keyword.

    python benchmarks/bench_triton_attention.py [--quick] [--page N] [--out PATH]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import checked_ratio, eager_ms, ratio_text  # noqa: E402
from bench_gpu_attention import (HKV, HQ, Batch, D, check_outputs,  # noqa: E402
                                 decode_bytes, flashinfer_direct, gpu_parser, mismatches, ours,
                                 prefill_flops, shown, time_graph, timed_fields, tuned,
                                 write_result)

DECODE = [(b, 32768) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)] + \
    [(b, c) for c in (1024, 8192) for b in (1, 8, 64, 256)]
PREFILL = [(1, s) for s in (1024, 4096, 8192, 16384)]
FLEX_POINTS = {("decode", 1, 32768), ("decode", 8, 8192), ("decode", 64, 8192),
               ("decode", 256, 8192), ("prefill", 1, 1024), ("prefill", 1, 8192)}


def flex_dense(b: Batch, prefill: bool):
    """Compiled flex_attention over dense per-request K/V (causal for prefill)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    m = b.meta
    n, ctx = m.num_reqs, int(m.seq_lens_cpu[0])
    qlen = b.q.shape[0] // n
    pages = b.meta.block_table[:, :b.pages].long()
    k = b.cache[pages, 0].reshape(n, -1, HKV, D)[:, :ctx].transpose(1, 2).contiguous()
    v = b.cache[pages, 1].reshape(n, -1, HKV, D)[:, :ctx].transpose(1, 2).contiguous()
    q = b.q.view(n, qlen, HQ, D).transpose(1, 2)
    mask = create_block_mask(mask_mod=lambda b_, h, qi, ki: qi + (ctx - qlen) >= ki, B=None,
                             H=None, Q_LEN=qlen, KV_LEN=ctx, device=b.q.device) \
        if prefill else None
    # Static shapes, each point compiled for its own: after a first recompile Dynamo would
    # compile flex_attention shape-generic, which runs the anchor far below its best (dense
    # decode at B=64 ctx 8k: 2.8 ms instead of 0.5).
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False)

    def run():  # (every point is another shape of one code object: more than Dynamo's 8)
        with torch._dynamo.config.patch(recompile_limit=256):
            o = fn(query=q, key=k, value=v, block_mask=mask, enable_gqa=True)
        b.out.copy_(o.transpose(1, 2).reshape(n * qlen, HQ, D))
    return run


def fused_combine(b: Batch, fused: bool):
    """TRITON_ATTN with split-KV partials always (``fused``) or never combined inside the
    attention launch (``triton.fused_combine``; by default it fuses from
    ``triton.fused_min_items`` (request, KV head) items on) -- identical to ``triton`` where a
    batch does not split."""
    return ours(b, "TRITON_ATTN", tuning=tuned(triton={"fused_combine": fused}))


def time_flex(fns: dict, rounds: int) -> tuple[dict[str, float], str]:
    """FLEX_ATTENTION and its dense anchor: as CUDA-graph replays like the others, or -- if
    capture fails (FLEX_ATTENTION declares no CUDA-graph support) -- both as eager launches
    (``do_bench``), so the pair is always timed alike."""
    try:
        return time_graph(fns, rounds), "cudagraph"
    except Exception as e:  # noqa: BLE001 (recorded, and the pair is re-timed eagerly)
        print(f"  flex: CUDA-graph timing failed ({type(e).__name__}: {str(e)[:120]}); "
              "timing both eagerly", flush=True)
        from triton.testing import do_bench

        return {n: do_bench(fn, rep=30, return_mode="median") for n, fn in fns.items()}, "eager"


def measure(kind: str, b: Batch, fns: dict, rounds: int, amount: float, unit: str,
            flex: dict | None = None, **shape) -> dict:
    """One point: outputs cross-checked against FlashInfer's, contenders timed, a result row
    (ratios only where the outputs agreed). A FLEX contender that fails to run (say, a kernel
    option past shared memory) is left out of the point with its error in the row."""
    errors = {}
    for name, fn in list((flex or {}).items()):
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (recorded)
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"  {name} failed: {errors[name]}", flush=True)
            del flex[name]
    if flex and ("flex" not in flex or "flex_dense" not in flex):
        flex = None  # (the pair is timed together or not at all)
    checks = check_outputs(b, {**fns, **(flex or {})}, "flashinfer")
    ms = time_graph(fns, rounds)
    row = {"kind": kind, **shape, "cross_check_vs_flashinfer": checks,
           "mismatch": mismatches(checks), "errors": errors}
    if flex:
        flex_ms, row["flex_timing"] = time_flex(flex, rounds)
        ms.update(flex_ms)
    row.update(timed_fields(ms, amount, unit))
    row["eager_us"] = {k: eager_ms(fn) * 1e3 for k, fn in fns.items()}
    # Ratios only between contenders that computed FlashInfer's output: TRITON_ATTN against
    # FlashInfer; FLEX_ATTENTION against its dense anchor when both agreed with it.
    row["flashinfer_over_triton"] = checked_ratio(ms["triton"], ms["flashinfer"],
                                                  checks["triton"])
    if flex:
        pair = checks["flex_dense"] if checks["flex"]["agree"] else checks["flex"]
        row["flex_dense_over_flex"] = checked_ratio(ms["flex"], ms["flex_dense"], pair)
    label = " ".join(f"{k}={v}" for k, v in shape.items())
    rate = {"tbs": "{:.2f}TB/s", "tflops": "{:.0f}TFLOP/s"}[unit]
    extra = f"  flex/dense {ratio_text(row['flex_dense_over_flex'])}" if flex else ""
    print(f"{kind:7s} {label:18s} " + "  ".join(
        f"{shown(k, checks)} {row[k + '_ms'] * 1e3:.1f}us " + rate.format(row[f"{k}_{unit}"])
        for k in ms)
        + f"  triton/flashinfer {ratio_text(row['flashinfer_over_triton'])}{extra}  max rel "
        f"err {checks['triton']['max_rel_err']:.2g}", flush=True)
    return row


def _flex(kind: str, b: Batch, shape: tuple, quick: bool) -> dict | None:
    if (kind, *shape) not in FLEX_POINTS and not quick:
        return None
    if b.cache.numel() >= 2**31:  # FLEX refuses it (32-bit offsets in FlexAttention's kernel)
        print(f"{kind} {shape}: FLEX_ATTENTION skipped, a cache of {b.cache.numel()} elements")
        return None
    from attn_ops.backends.flex_attention_gather import GATHER_PAGE

    fns = {"flex": ours(b, "FLEX_ATTENTION")}
    if kind == "decode":
        fns["flex_default_stages"] = ours(b, "FLEX_ATTENTION",
                                          tuning=tuned(flex={"decode_stages": None}))
    elif b.page < GATHER_PAGE:
        fns["flex_paged"] = ours(b, "FLEX_ATTENTION",
                                 tuning=tuned(flex={"gather_min_pairs_per_key_gpu": None}))
    return {**fns, "flex_dense": flex_dense(b, kind == "prefill")}


def main() -> None:
    args = gpu_parser(__doc__, "bench_triton_attention_h200.json", page=16,
                      rounds=2).parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []

    def save(complete=False):
        write_result("bench_triton_attention", args.out, quiet=not complete, quick=args.quick,
                     page=args.page, rows=rows, complete=complete,
                     method="median over rotating rounds of do_bench_cudagraph medians "
                            "(flex pair: see flex_timing)")

    for bsz, ctx in ([(1, 4096), (64, 4096)] if args.quick else DECODE):
        b = Batch(bsz, ctx, 1, args.page, gen)
        fns = {"triton": ours(b, "TRITON_ATTN"), "triton_fused": fused_combine(b, True),
               "triton_two_launches": fused_combine(b, False),
               "triton_pps16": ours(b, "TRITON_ATTN", tuning=tuned(triton={"programs_per_sm": 16})),
               "flashinfer": flashinfer_direct(b, False),
               "flashinfer_tc": flashinfer_direct(b, False, tensor_cores=True)}
        rows.append(measure("decode", b, fns, args.rounds, decode_bytes(bsz, ctx), "tbs",
                            _flex("decode", b, (bsz, ctx), args.quick), batch=bsz, ctx=ctx))
        save()
        del b, fns
    for bsz, s in ([(1, 4096)] if args.quick else PREFILL):
        b = Batch(bsz, s, s, args.page, gen)
        fns = {"triton": ours(b, "TRITON_ATTN"), "flashinfer": flashinfer_direct(b, True)}
        rows.append(measure("prefill", b, fns, args.rounds, prefill_flops(bsz, s), "tflops",
                            _flex("prefill", b, (bsz, s), args.quick), batch=bsz, seq=s))
        save()
        del b, fns
    save(complete=True)


if __name__ == "__main__":
    main()
